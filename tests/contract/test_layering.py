"""The architecture as tests: the planner imports no runtime and no torch; only offload_plan.runtime_seam
reaches the runtime; every command's --help works through the installed script and through python -m; and
without torch the planner's commands work while run and calibrate say how to install the runtime.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from offload_plan.app import app
from planner.model.cost import ComputeTimes
from planner.make.make_plan import make_plan
from planner.make.inputs import regenerate_command
from planner.plan.schema import Inputs
from planner.plan.file import render_plan
from tests.conftest import REPO_ROOT, TEST_GPU, assert_one_line_error, cli_env, make_checkpoint

FORBIDDEN_IN_PLANNER = ("runtime", "torch", "transformers", "offload_plan")
COMMANDS = sorted(command.name for command in app.registered_commands)


def _imported_roots(path: Path) -> set[str]:
    """Top-level package of every import in the file, at any depth (functions included)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "planner").rglob("*.py")),
                         ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_planner_imports_no_runtime_and_no_torch(path):
    assert not _imported_roots(path) & set(FORBIDDEN_IN_PLANNER), f"{path.name} imports the runtime or torch"


def test_the_ast_check_sees_imports_inside_functions(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f():\n    if True:\n        from runtime.measure import measured_compute\n")
    assert "runtime" in _imported_roots(sneaky)


def test_only_the_seam_imports_the_runtime():
    importers = {path.relative_to(REPO_ROOT).as_posix() for path in (REPO_ROOT / "offload_plan").rglob("*.py")
                 if _imported_roots(path) & {"runtime", "torch", "transformers"}}
    assert importers == {"offload_plan/runtime_seam.py"}


def test_every_command_is_registered():
    assert COMMANDS == ["calibrate", "check", "diff", "export", "header-checkpoint", "make", "profiles", "run", "show",
                        "trace"]


def _installed_script() -> Path | None:
    """This interpreter's offload-plan script, when it runs this tree's entry point (else None: skip)."""
    script = Path(sys.executable).parent / "offload-plan"
    if not script.is_file() or "offload_plan.app" not in script.read_text(errors="replace"):
        return None
    where = subprocess.run([str(script.parent / "python"), "-c", "import offload_plan; print(offload_plan.__file__)"],
                           env=cli_env(), capture_output=True, text=True)
    return script if where.stdout.strip().startswith(str(REPO_ROOT)) else None


@pytest.mark.parametrize("launcher", ["python -m", "installed script"])
def test_every_command_help(launcher, tmp_path):
    if launcher == "installed script":
        script = _installed_script()
        if script is None:
            pytest.skip("the offload-plan on this interpreter's PATH is not this tree's (pip install -e . installs it)")
        prefix = [str(script)]
    else:
        prefix = [sys.executable, "-m", "offload_plan"]
    for command in ["", *COMMANDS]:
        args = [*prefix, *([command] if command else []), "--help"]
        proc = subprocess.run(args, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (args, proc.stderr)
        # the project's help text (each command's docstring example, the app's help), not click's frame
        assert ("Example:" if command else "Plan, explain and apply") in proc.stdout, args
        assert f"offload-plan {command}" in proc.stdout or not command, args


# ---- without torch ------------------------------------------------------------------------------------------

#: run the CLI as if torch and transformers were not installed (imports of them fail, find_spec finds nothing)
WITHOUT_TORCH = ("import sys\n"
                 "for name in ('torch', 'transformers', 'safetensors'): sys.modules[name] = None\n"
                 "from offload_plan.app import main\n"
                 "sys.argv = ['offload-plan', *sys.argv[1:]]\n"
                 "main()\n")


def _without_torch(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *map(str, args)], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=120)


def _fake_measure(checkpoint, layout, workload, profile, measured_on, graphed) -> ComputeTimes:
    """Stands in for a GPU: fixed times with more decimals than a plan keeps."""
    return ComputeTimes(layer_ms=tuple(0.123456789 * (i + 1) for i in range(len(layout.layers))),
                        head_ms=0.0987654321, source="measured: a test stand-in")


@pytest.fixture
def measured_plan(workdir, test_gpu) -> Path:
    make_checkpoint(workdir / "ckpt", num_layers=4)
    inputs = Inputs(model="ckpt", revision=None, gpu=test_gpu, budget="200KiB", trigger=None, tokens=64,
                    sequences=1, context=0, params=(), stack=None, group_size=None, num_in_group=None,
                    prefetch_step=None, measure=True, measured_on="h100-sxm")
    path = workdir / "measured.yaml"
    planned = make_plan(inputs, measure=_fake_measure)
    path.write_text(render_plan(planned.plan, regenerate_command(inputs, "measured.yaml")))
    return path


def test_measure_without_a_measuring_function_is_a_usage_error(workdir, test_gpu):
    from planner.errors import UsageError

    make_checkpoint(workdir / "ckpt", num_layers=4)
    inputs = Inputs(model="ckpt", revision=None, gpu=test_gpu, budget=None, trigger=None, tokens=64, sequences=1,
                    context=0, params=(), stack=None, group_size=None, num_in_group=None, prefetch_step=None,
                    measure=True)
    with pytest.raises(UsageError, match="--measure times layers on the local GPU"):
        make_plan(inputs)


def test_a_measure_plan_checks_from_its_recorded_times_without_torch(measured_plan, workdir):
    proc = _without_torch(["check", measured_plan.name], workdir)
    assert proc.returncode == 0, proc.stderr
    assert "1 plan(s) up to date" in proc.stderr


def test_planner_commands_work_without_torch(measured_plan, workdir):
    made = _without_torch(["make", "-m", "ckpt", "-g", TEST_GPU, "--budget", "200KiB", "-o", "p.yaml"], workdir)
    assert made.returncode == 0, made.stderr
    for args in (["show", "p.yaml"], ["diff", "p.yaml", measured_plan.name], ["profiles"],
                 ["export", "p.yaml", "--to", "vllm"], ["check", "p.yaml"]):
        proc = _without_torch(args, workdir)
        assert proc.returncode == 0, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [["run", "PLAN", "--bench"], ["calibrate"],
                                  ["make", "-m", "ckpt", "-g", TEST_GPU, "--measure"]])
def test_runtime_commands_without_torch_name_the_extra(measured_plan, workdir, args):
    args = [measured_plan.name if a == "PLAN" else a for a in args]
    proc = _without_torch(args, workdir)
    assert proc.returncode == 7, proc.stderr
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout,
                          contains=("needs the runtime", "pip install 'offload-plan[runtime]'"))
