"""The install from a clone (issue 26): pyproject bounds every dependency to the range the project is tested on,
the installed versions lie in it, and ``pip wheel .`` builds a wheel that carries every module and profile."""

import importlib.util
import re
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata

import pytest

from tests.conftest import REPO_ROOT

packaging_requirements = pytest.importorskip("packaging.requirements")
packaging_version = pytest.importorskip("packaging.version")


def _requirements() -> list:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines.extend(extra)
    return [packaging_requirements.Requirement(line) for line in lines]


def test_every_dependency_has_a_tested_low_and_high_bound():
    for requirement in _requirements():
        operators = {spec.operator for spec in requirement.specifier}
        assert ">=" in operators and "<" in operators, f"{requirement}: give the tested range, low and high"


def test_installed_dependencies_lie_in_their_bounds():
    """What the suite runs on is what pyproject admits (a dependency outside it is untested)."""
    for requirement in _requirements():
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # an extra not installed here (bench's accelerate, say)
        local = version.split("+")[0]  # torch's +cpu / +cu128 builds
        assert requirement.specifier.contains(local, prereleases=True), f"{requirement.name} {version}: {requirement}"


def test_tested_versions_page_names_every_dependency():
    page = (REPO_ROOT / "docs" / "tested-versions.md").read_text().lower()
    for requirement in _requirements():
        assert requirement.name.lower() in page, f"docs/tested-versions.md does not name {requirement.name}"


def _can_build_here() -> bool:
    """This interpreter's setuptools builds wheels itself (70.1+ has bdist_wheel; older ones need the wheel
    package), so the test needs no network."""
    try:
        import setuptools
    except ImportError:
        return False
    version = packaging_version.Version(setuptools.__version__)
    return version >= packaging_version.Version("70.1") or importlib.util.find_spec("wheel") is not None


def test_wheel_carries_every_module_and_profile(tmp_path):
    """``pip wheel .`` (what a user without -e gets): the three packages, the built-in profiles, the script."""
    isolation = ["--no-build-isolation"] if _can_build_here() else []  # else pip fetches setuptools (as CI can)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO_ROOT), "--no-deps", *isolation,
                           "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("offload_plan-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("planner", "runtime", "offload_plan"):
        for module in (REPO_ROOT / package).rglob("*.py"):
            name = module.relative_to(REPO_ROOT).as_posix()
            assert name in names, f"{name} missing from {wheel.name}"
    for profile in (REPO_ROOT / "profiles").glob("*.yaml"):
        assert f"planner/_profiles/{profile.name}" in names, f"profile {profile.name} missing from {wheel.name}"
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "offload-plan = offload_plan.app:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _two_commands_lines() -> list[str]:
    """The command lines of the README's "The two commands" section: its ```bash blocks, in order."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("\n## The two commands\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_two_commands_are_what_ci_runs():
    """The README's set-up (two lines), its main job and its test command are four lines, and .ci/run runs each
    exactly as written, in that order: a user who copies them does what CI proves."""
    lines = _two_commands_lines()
    assert len(lines) == 4, f"README's 'The two commands' holds {len(lines)} command lines, not set-up (2), the " \
                            "main job and the tests"
    assert lines[-1] == "python3 -m pytest -q"
    ci = [line for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    positions = [ci.index(line) if line in ci else -1 for line in lines]
    assert -1 not in positions, f".ci/run does not run README's {lines[positions.index(-1)]!r} as written"
    assert positions == sorted(positions), ".ci/run runs README's two commands in another order"
