"""The command line as one application: errors handled once in offload_plan.app, -h, --version.

Every failure is one line on stderr: project errors with their exit code, usage errors naming the command
(exit 2), anything else as a bug (exit 70) unless OFFLOAD_PLAN_DEBUG=1 asks for the traceback.
"""

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, assert_one_line_error, cli_env, invoke, run_cli

USAGE, BUG = 2, 70


# The fragments are the project's framing ("COMMAND: ... (see offload-plan COMMAND -h)") and the words the user
# typed; click's own wording ("Missing option", "No such option") changes between releases and is not asserted.
@pytest.mark.parametrize("args, fragments", [
    (["make"], ["make: ", "--model", "(see offload-plan make -h)"]),
    (["make", "-m", "x", "-g", "h100-sxm", "--tokens", "many"], ["make: ", "--tokens", "(see offload-plan make -h)"]),
    (["show"], ["show: ", "(see offload-plan show -h)"]),
    (["export", "plan.yaml", "--to", "vllm", "--colour"], ["export: ", "--colour", "(see offload-plan export -h)"]),
    (["bogus"], ["bogus", "(see offload-plan -h)"]),
    (["--bogus"], ["--bogus", "(see offload-plan -h)"]),
])
def test_usage_errors_are_one_line_naming_the_command(tmp_path, args, fragments):
    proc = run_cli(args, tmp_path)
    assert proc.returncode == USAGE
    assert "╭" not in proc.stderr and "Usage:" not in proc.stderr  # no boxed panel, no usage block
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, contains=tuple(fragments))


def _crash(*args, **kwargs):
    raise ZeroDivisionError("division by zero in the search")


def test_unexpected_exception_is_one_line_naming_command_and_input(monkeypatch, tmp_path):
    monkeypatch.setattr("planner.make.make_plan.make_plan", _crash)
    monkeypatch.delenv("OFFLOAD_PLAN_DEBUG", raising=False)
    result = invoke(["make", "-m", "some/model", "-g", "h100-sxm"], catch_exceptions=True)
    assert result.exit_code == BUG
    line = assert_one_line_error(result.exit_code, result.stderr, result.stdout,
                                 contains=("make failed unexpectedly", "ZeroDivisionError", "make -m some/model",
                                           "this is a bug", "OFFLOAD_PLAN_DEBUG=1"))
    assert "Traceback" not in line


def _run_crashing(env_extra: dict) -> subprocess.CompletedProcess:
    """The real entry point in a subprocess, with make_plan replaced by a function that raises."""
    code = ("import planner.make.make_plan, offload_plan.app as app\n"
            "def crash(*a, **k): raise ZeroDivisionError('boom')\n"
            "planner.make.make_plan.make_plan = crash\n"
            "import sys; sys.argv = ['offload-plan', 'make', '-m', 'org/model', '-g', 'h100-sxm']\n"
            "app.main()\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=cli_env(**env_extra),
                          capture_output=True, text=True, timeout=120)


def test_debug_switch_shows_the_traceback():
    quiet = _run_crashing({})
    assert quiet.returncode == BUG
    assert_one_line_error(quiet.returncode, quiet.stderr, contains=("this is a bug",))
    loud = _run_crashing({"OFFLOAD_PLAN_DEBUG": "1"})
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "ZeroDivisionError: boom" in loud.stderr


def test_project_error_in_debug_mode_shows_the_traceback(tmp_path):
    proc = run_cli(["show", "missing.yaml"], tmp_path, env=cli_env(OFFLOAD_PLAN_DEBUG="1"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "PlanError" in proc.stderr


def test_control_characters_in_input_are_escaped(tmp_path):
    proc = run_cli(["make", "-m", "evil\x1b[31m\nsecond line", "-g", "h100-sxm"], tmp_path)
    line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout)
    assert "\x1b" not in proc.stderr and "\\x1b[31m\\nsecond line" in line


def test_keyboard_interrupt_exits_130(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("planner.make.make_plan.make_plan", interrupted)
    result = invoke(["make", "-m", "org/model", "-g", "h100-sxm"], catch_exceptions=True)
    assert result.exit_code == 130 and "interrupted" in result.stderr


def test_version_and_short_help(tmp_path):
    from offload_plan import __version__

    version = run_cli(["--version"], tmp_path)
    assert version.returncode == 0 and version.stdout == f"offload-plan {__version__}\n"
    assert __version__ != "unknown"
    for args in (["-h"], ["make", "-h"], ["check", "-h"]):
        result = invoke(args)
        # the project's help text (the command's docstring example, the app's one-line help), not click's frame
        expected = "Example:" if len(args) > 1 else "Plan, explain and apply"
        assert result.exit_code == 0 and expected in result.stdout, args


def test_human_reports_go_to_stdout_and_progress_to_stderr(workdir, test_gpu):
    from tests.conftest import make_checkpoint

    make_checkpoint(workdir / "ckpt", num_layers=4)
    made = run_cli(["make", "-m", "ckpt", "-g", test_gpu, "--budget", "200KiB"], workdir)
    assert made.returncode == 0 and made.stdout.startswith("# Offload plan") and "layers offloaded" in made.stderr
    (workdir / "plan.yaml").write_text(made.stdout)
    shown = run_cli(["show", "plan.yaml"], workdir)
    assert shown.returncode == 0 and shown.stderr == "" and "Plan" in shown.stdout and "compute |" in shown.stdout
    listed = run_cli(["profiles"], workdir)
    assert listed.returncode == 0 and listed.stderr == "" and "h100-sxm" in listed.stdout
    compared = run_cli(["diff", "plan.yaml", "plan.yaml"], workdir)
    assert compared.returncode == 0 and compared.stderr == "" and "G / K / P" in compared.stdout
    exported = run_cli(["export", "plan.yaml", "--to", "vllm"], workdir)
    assert exported.returncode == 0 and exported.stdout.startswith("--offload-group-size ")
    assert exported.stdout.count("\n") == 1 and "predicted step" in exported.stderr  # $(...) gets the flags only
