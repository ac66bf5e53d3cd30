"""scripts/tree_stats.py: function lengths by ast, nearest-rank percentiles, the working tree's modules."""

import subprocess
import sys

import pytest

from scripts import tree_stats
from tests.conftest import REPO_ROOT

SOURCE = '''\
def top():
    """Doc."""

    def inner():
        return 1

    return inner()


class Engine:
    @property
    def width(self):
        return 2

    async def step(self):
        pass
'''


def test_every_def_is_counted_with_its_dotted_name_and_length():
    found = {f.name: (f.first_line, f.num_lines) for f in tree_stats.functions_of("m.py", SOURCE)}
    assert found == {"top": (1, 7), "top.<locals>.inner": (4, 2), "Engine.width": (12, 2), "Engine.step": (15, 2)}


@pytest.mark.parametrize(("values", "share", "expected"), [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.9, 9),
    ([10, 1], 0.9, 10),
    ([5], 0.5, 5),
    ([1, 2, 3, 4], 0.5, 2),
])
def test_nearest_rank_percentile(values, share, expected):
    assert tree_stats.percentile(values, share) == expected


def test_modules_without_a_test_file_named_after_them():
    modules = ["planner/make/make_plan.py", "planner/model/cost.py", "planner/__init__.py", "runtime/load.py",
               "offload_plan/app.py"]
    tests = ["tests/planner/test_make_plan.py", "tests/test_load.py"]
    assert tree_stats.untested(modules, tests) == ["planner/model/cost.py"]


def test_working_tree_counts_the_lines_and_functions_on_disk():
    stats = tree_stats.tree_stats(None)
    by_path = {module.path: module for module in stats.modules}
    make = by_path["planner/make/make_plan.py"]
    assert make.num_lines == len((REPO_ROOT / "planner/make/make_plan.py").read_text().splitlines())
    assert make.num_functions == sum(1 for f in tree_stats.functions_of("x", (REPO_ROOT / "planner/make/make_plan.py")
                                                                        .read_text()))
    assert {path.split("/")[0] for path in by_path} == set(tree_stats.PACKAGES)
    assert not any(path.startswith(("tests/", "scripts/")) for path in by_path)
    assert len(stats.longest) == tree_stats.NUM_LONGEST
    assert [f.num_lines for f in stats.longest] == sorted((f.num_lines for f in stats.longest), reverse=True)
    assert stats.p90_function_lines >= stats.median_function_lines > 0


def test_cli_prints_the_report_and_refuses_an_unknown_revision_in_one_line():
    done = subprocess.run([sys.executable, "scripts/tree_stats.py"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "planner/:" in done.stdout and "the 10 longest:" in done.stdout
    bad = subprocess.run([sys.executable, "scripts/tree_stats.py", "--rev", "no-such-rev-xyz"], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
