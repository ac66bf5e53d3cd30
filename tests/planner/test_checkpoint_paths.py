"""Model paths in plans and check on a fresh clone: each fails in one line or works.

A plan records a local model path as given (relative to where make ran, or absolute); run resolves a relative
one from the working directory, else from the plan's folder and its parents, so it works from anywhere.
"""

from pathlib import Path

import pytest
import yaml

from planner.source.checkpoint import resolve_local_source
from planner.errors import ModelInputError
from tests.conftest import REPO_ROOT, assert_one_line_error, invoke, make_checkpoint, run_cli


@pytest.fixture
def project(workdir, test_gpu) -> Path:
    """A project folder with a checkpoint and a plan made from its root into plans/."""
    make_checkpoint(workdir / "models" / "tiny", num_layers=4)
    (workdir / "plans").mkdir()
    result = invoke(["make", "-m", "models/tiny", "-g", test_gpu, "--budget", "200KiB", "-o", "plans/tiny.yaml"])
    assert result.exit_code == 0, result.stderr
    return workdir


def test_relative_paths_are_recorded_as_given_and_absolute_ones_stay_absolute(project, test_gpu):
    plan = yaml.safe_load((project / "plans" / "tiny.yaml").read_text())
    assert plan["inputs"]["model"] == plan["model"]["source"] == "models/tiny"
    absolute = str(project / "models" / "tiny")
    result = invoke(["make", "-m", absolute, "-g", test_gpu, "--budget", "200KiB", "-o", "abs.yaml"])
    assert result.exit_code == 0, result.stderr
    assert yaml.safe_load((project / "abs.yaml").read_text())["model"]["source"] == absolute


def test_a_relative_source_resolves_from_any_directory(project, monkeypatch):
    plan_path = project / "plans" / "tiny.yaml"
    monkeypatch.chdir(project / "plans")
    assert resolve_local_source("models/tiny", Path("tiny.yaml")) == str(project / "models" / "tiny")
    monkeypatch.chdir("/")
    assert resolve_local_source("models/tiny", plan_path) == str(project / "models" / "tiny")
    assert resolve_local_source("org/model", plan_path) == "org/model"  # a hub id
    with pytest.raises(ModelInputError, match="pass --model PATH"):
        resolve_local_source("./gone/tiny", plan_path)


def test_run_from_another_directory_finds_the_checkpoint(project):
    """run gets past the model path (the next thing it needs is a CUDA GPU, absent here)."""
    elsewhere = run_cli(["run", str(project / "plans" / "tiny.yaml"), "--bench"], cwd="/")
    line = assert_one_line_error(elsewhere.returncode, elsewhere.stderr, elsewhere.stdout)
    assert "not under the working directory" not in line and elsewhere.returncode == 7, line


def test_check_without_the_checkpoints_names_the_build_step_in_one_line(tmp_path):
    """A fresh clone has plans/ but not .cache/checkpoints: one line naming scripts/real_checkpoints.py."""
    (tmp_path / "plans").mkdir()
    for plan in sorted((REPO_ROOT / "plans").glob("*.yaml"))[:3]:
        (tmp_path / "plans" / plan.name).write_text(plan.read_text())
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "real_checkpoints.py").write_text("# stands in for the builder\n")
    proc = run_cli(["check", *sorted(p.name for p in (tmp_path / "plans").iterdir())], tmp_path / "plans")
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, contains=("not here", "download or build"))
    proc = run_cli(["check", *sorted(f"plans/{p.name}" for p in (tmp_path / "plans").iterdir())], tmp_path)
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout,
                          contains=("3 plan(s) name 2 checkpoint(s) that are not here (.cache/checkpoints/",
                                    "build them first with python3 scripts/real_checkpoints.py"))
    assert proc.stdout == ""


def test_a_copied_plan_passes_check(project):
    """The header records make's -o; a copy under another name is the same plan (issue 26: it failed)."""
    plan = project / "plans" / "tiny.yaml"
    (project / "plans" / "copy.yaml").write_text(plan.read_text())
    (project / "elsewhere.yaml").write_text(plan.read_text())
    for path in ("plans/copy.yaml", "elsewhere.yaml"):
        result = invoke(["check", path])
        assert result.exit_code == 0, (path, result.stderr, result.stdout)


def test_check_resolves_a_relative_model_from_the_plan_folder(project):
    """make ran in the project root with -m models/tiny; check passes from plans/ and from /."""
    for cwd, path in ((project / "plans", "tiny.yaml"), (Path("/"), str(project / "plans" / "tiny.yaml"))):
        proc = run_cli(["check", path], cwd)
        assert proc.returncode == 0, (cwd, proc.stderr)
    assert Path.cwd() == project  # check went back to the working directory
    edited = (project / "plans" / "tiny.yaml").read_text() + "# edited by hand\n"
    (project / "plans" / "edited.yaml").write_text(edited)
    proc = run_cli(["check", "edited.yaml"], project / "plans")
    assert proc.returncode != 0 and "fix: offload-plan make" in proc.stderr and "-o edited.yaml" in proc.stderr
