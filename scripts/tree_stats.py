"""The shape of the tree: lines per module, the longest functions, function lengths, tests named by module.

For issue 24's note (the tree before and after), and rerunnable at any commit or on the working tree:

    PYTHONPATH=. python3 scripts/tree_stats.py                   # the working tree (tracked and untracked, not ignored)
    PYTHONPATH=. python3 scripts/tree_stats.py --rev 1d7cc5a     # a commit, read through git (no checkout)
    PYTHONPATH=. python3 scripts/tree_stats.py --rev main --json

It reads the packages the product ships (planner/, runtime/, offload_plan/ with its commands) as text and parses
them with ``ast``; nothing is imported or run. A function's length is its lines from ``def`` to its last line
(decorators not counted; its docstring, blank lines and comments counted), every def counted once: methods and
nested functions too, a nested one also inside its parent's length. Percentiles are nearest-rank (p90: the
length 90% of functions are at or under). A module "has a test file" where a file named ``test_<module>.py``
lies anywhere under tests/.

1d7cc5a is the tree issue 24 describes: its figures are the issue's (planner/make/make_plan.py 709 lines,
planner/plan/schema.py
724, runtime/stream_load.py 627 in 46 functions, _assemble 83 lines, 15 of 24 planner modules without a test
file, median 8 lines).
"""

import argparse
import ast
import json
import math
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: the packages whose modules are counted
PACKAGES = ("planner", "runtime", "offload_plan")
#: how many of the longest functions are listed
NUM_LONGEST = 10


@dataclass(frozen=True, kw_only=True)
class Function:
    """One def: where it is and how long."""

    #: e.g. planner/make/make_plan.py
    path: str
    #: dotted name inside the module, e.g. Engine.forward or make.<locals>.number
    name: str
    first_line: int
    num_lines: int


@dataclass(frozen=True, kw_only=True)
class Module:
    """One .py file of a package."""

    path: str
    num_lines: int
    num_functions: int


@dataclass(frozen=True, kw_only=True)
class TreeStats:
    """What ``report`` prints."""

    #: the revision read, or "working tree"
    source: str
    modules: tuple[Module, ...]
    longest: tuple[Function, ...]
    num_functions: int
    median_function_lines: float
    p90_function_lines: int
    #: modules of planner/ and runtime/ with no tests/**/test_<module>.py
    untested_modules: tuple[str, ...]
    num_test_files: int
    readme_words: int


def _git(*args: str) -> str:
    """stdout of a git command in the repository; a failure is one line and exit 2."""
    done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        sys.exit(f"tree_stats: git {' '.join(args)} failed: {last}")
    return done.stdout


def list_files(rev: str | None) -> list[str]:
    """Paths (relative to the repository) at ``rev``, or in the working tree (tracked and untracked, not
    ignored, still present) where it is None."""
    if rev is not None:
        return _git("ls-tree", "-r", "--name-only", rev).splitlines()
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard").splitlines()
    return sorted({path for path in listed if (REPO_ROOT / path).is_file()})


def read_text(rev: str | None, path: str) -> str:
    """A file's text at ``rev`` (None: the working tree)."""
    if rev is None:
        return (REPO_ROOT / path).read_text()
    return _git("show", f"{rev}:{path}")


def functions_of(path: str, text: str) -> list[Function]:
    """Every def in the module (methods and nested ones included), with its dotted name and length."""
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append(Function(path=path, name=name, first_line=child.lineno,
                                      num_lines=child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(text, filename=path), "")
    return found


def percentile(values: list[int], share: float) -> int:
    """Nearest-rank percentile: the smallest value with at least ``share`` of ``values`` at or under it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def untested(modules: list[str], test_files: list[str]) -> list[str]:
    """planner/ and runtime/ modules with no test file named after them anywhere under tests/."""
    named = {Path(path).name for path in test_files}
    return [path for path in modules if path.split("/")[0] in ("planner", "runtime")
            and Path(path).stem != "__init__" and f"test_{Path(path).stem}.py" not in named]


def tree_stats(rev: str | None) -> TreeStats:
    """The statistics of ``rev`` (None: the working tree)."""
    files = list_files(rev)
    sources = [path for path in files if path.endswith(".py") and path.split("/")[0] in PACKAGES]
    modules, functions = [], []
    for path in sources:
        text = read_text(rev, path)
        found = functions_of(path, text)
        functions += found
        modules.append(Module(path=path, num_lines=len(text.splitlines()), num_functions=len(found)))
    lengths = [function.num_lines for function in functions]
    tests = [path for path in files if path.startswith("tests/") and Path(path).name.startswith("test_")
             and path.endswith(".py")]
    readme = read_text(rev, "README.md") if "README.md" in files else ""
    return TreeStats(
        source=rev or "working tree", modules=tuple(modules),
        longest=tuple(sorted(functions, key=lambda f: (-f.num_lines, f.path, f.first_line))[:NUM_LONGEST]),
        num_functions=len(functions), median_function_lines=statistics.median(lengths) if lengths else 0,
        p90_function_lines=percentile(lengths, 0.9) if lengths else 0,
        untested_modules=tuple(untested(sources, tests)), num_test_files=len(tests),
        readme_words=len(readme.split()))


def report(stats: TreeStats) -> str:
    """The statistics as text: per package, per module (longest first), the longest functions."""
    lines = [f"# tree statistics of {stats.source}", ""]
    for package in PACKAGES:
        members = [m for m in stats.modules if m.path.split("/")[0] == package]
        lines.append(f"{package}/: {len(members)} modules, {sum(m.num_lines for m in members)} lines")
        for module in sorted(members, key=lambda m: (-m.num_lines, m.path)):
            lines.append(f"  {module.num_lines:6d}  {module.path}  ({module.num_functions} functions)")
    lines += ["", f"functions: {stats.num_functions}, median {stats.median_function_lines:g} lines, "
                  f"p90 {stats.p90_function_lines} lines", f"the {len(stats.longest)} longest:"]
    lines += [f"  {f.num_lines:4d}  {f.path}:{f.first_line}  {f.name}" for f in stats.longest]
    lines += ["", f"tests: {stats.num_test_files} test files"]
    for package in ("planner", "runtime"):
        counted = [m.path for m in stats.modules if m.path.split("/")[0] == package
                   and not m.path.endswith("__init__.py")]
        missing = [path for path in stats.untested_modules if path in counted]
        lines.append(f"  {package}/: {len(missing)} of {len(counted)} modules have no test_<module>.py")
    lines += [
              f"README.md: {stats.readme_words} words"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the statistics of --rev (default: the working tree), as text or --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default=None, help="a git revision to read (default: the working tree)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    stats = tree_stats(args.rev)
    print(json.dumps(asdict(stats), indent=1) if args.json else report(stats))


if __name__ == "__main__":
    main()
