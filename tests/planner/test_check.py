"""check on tiny hand-written checkpoints and the round-number test profile: a fresh plan passes; an edited plan,
a changed profile, a changed checkpoint, a file that is not a plan each fail with their exit code, a diff where
one applies, and the command that fixes it."""

import json
import shlex
import shutil

import pytest
import yaml

from tests.conftest import ERROR_PREFIX, invoke, make_checkpoint
from tests.plan_cli import INFEASIBLE, MODEL, OK, PLAN, STALE, cli_make, replace_once


def _check(*args):
    return invoke(["check", *args], catch_exceptions=False)


def _assert_failed(result, code: int) -> str:
    """Exit code, no traceback, and the last stderr line is the one-line summary error."""
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(ERROR_PREFIX), last
    return last


def test_check_passes_on_a_fresh_plan(dense):
    result = _check("plan.yaml")
    assert result.exit_code == OK, result.stderr
    assert "ok plan.yaml" in result.stderr and "1 plan(s) up to date" in result.stderr
    assert result.stdout == ""


def test_check_fails_on_an_edited_plan_with_diff_and_fix(dense):
    replace_once("plan.yaml", f"prefetch_step: {dense['offload']['prefetch_step']}\n  params",
          f"prefetch_step: {dense['offload']['prefetch_step'] + 1}\n  params")
    result = _check("plan.yaml")
    last = _assert_failed(result, STALE)
    assert "plan.yaml (stale)" in last
    assert result.stdout.startswith("--- plan.yaml\n+++ plan.yaml (regenerated)\n")
    assert f"-  prefetch_step: {dense['offload']['prefetch_step'] + 1}" in result.stdout
    assert f"+  prefetch_step: {dense['offload']['prefetch_step']}" in result.stdout
    header_command = open("plan.yaml").read().splitlines()[1].lstrip("#").strip()
    assert f"fix: {header_command}" in result.stderr


def test_check_update_rewrites_the_plan(dense):
    original = open("plan.yaml").read()
    replace_once("plan.yaml", "step_ms:", "step_ms: 1.0\n  old_step_ms:")  # not even a valid plan key any more
    assert _check("plan.yaml").exit_code == PLAN  # invalid files cannot be regenerated from their inputs
    open("plan.yaml", "w").write(original.replace("tokens_per_step: 2048", "tokens_per_step: 2048 ", 1))
    result = _check("--update", "plan.yaml")
    assert result.exit_code == OK, result.stderr
    assert "updated plan.yaml" in result.stderr
    assert open("plan.yaml").read() == original
    assert _check("plan.yaml").exit_code == OK


def test_check_fails_when_the_profile_changes(workdir, own_profile):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    cli_make(["--gpu", "my-gpu.yaml", "--budget", "500KB"])
    replace_once(own_profile, "value: 1.0e+9", "value: 2.0e+9")  # a faster host link
    result = _check("plan.yaml")
    _assert_failed(result, STALE)
    assert "-  h2d_bytes_per_s: 1000000000.0\n+  h2d_bytes_per_s: 2000000000.0\n" in result.stdout


def test_check_fails_when_the_plan_no_longer_fits(workdir, own_profile):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    cli_make(["--gpu", "my-gpu.yaml", "--budget", "500KB"])
    # 400 KB of memory less 100 MB reserve is refused by the profile itself; shrink memory and reserve together
    replace_once(own_profile, "value: 1000000000\n", "value: 400000\n")
    replace_once(own_profile, "value: 100000000\n", "value: 100000\n")
    result = _check("--json", "plan.yaml")
    assert result.exit_code == INFEASIBLE
    (entry,) = json.loads(result.stdout)
    kinds = [p["kind"] for p in entry["problems"]]
    assert kinds[0] == "fit" and entry["exit_code"] == INFEASIBLE
    assert "no longer fits test-gpu" in entry["problems"][0]["message"]


def test_check_passes_a_plan_made_without_a_budget(workdir, own_profile):
    """make's whole-GPU default (no --budget) gives the weights what the KV cache, activations and CUDA context
    leave, past the profile's reserve; check holds that plan to the same rule, not to memory less reserve."""
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    replace_once(own_profile, "value: 100000000\n", "value: 500000000\n")  # a reserve the whole-GPU budget passes
    plan = cli_make(["--gpu", "my-gpu.yaml", "--context", "64"])
    reserve_limit = 1_000_000_000 - 500_000_000
    assert plan["memory"]["budget_bytes"] > reserve_limit  # the case check refused before
    assert _check("plan.yaml").exit_code == OK


def test_check_fix_command_refits_a_plan_made_without_a_budget(workdir, own_profile):
    """A whole-GPU plan whose profile shrank fails check as not fitting; the fix command check prints writes a plan
    that passes, and so does check --update."""
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    cli_make(["--gpu", "my-gpu.yaml", "--context", "64"])
    shutil.copy("plan.yaml", "copy.yaml")
    replace_once(own_profile, "value: 1000000000\n", "value: 900000000\n")
    result = _check("--json", "plan.yaml")
    assert result.exit_code == INFEASIBLE, result.stderr
    (entry,) = json.loads(result.stdout)
    assert entry["problems"][0]["kind"] == "fit"
    words = shlex.split(entry["fix_command"])
    assert words[:2] == ["offload-plan", "make"] and "--budget" not in words
    assert invoke(words[1:]).exit_code == OK
    assert yaml.safe_load(open("plan.yaml").read())["memory"]["gpu_memory_bytes"] == 900_000_000
    assert _check("plan.yaml").exit_code == OK
    assert _check("--update", "copy.yaml").exit_code == OK
    assert _check("copy.yaml").exit_code == OK


def test_check_fails_on_fingerprint_mismatch(dense, workdir):
    shutil.rmtree(workdir / "ckpt")
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3, intermediate=96)  # other shapes
    result = _check("--json", "plan.yaml")
    assert result.exit_code == PLAN
    (entry,) = json.loads(result.stdout)
    assert [p["kind"] for p in entry["problems"]][:1] == ["fingerprint"]
    assert "stale" in [p["kind"] for p in entry["problems"]]
    assert entry["fix_command"].startswith("offload-plan make --model ckpt")


def test_check_fails_when_the_checkpoint_is_gone(dense, workdir):
    shutil.rmtree(workdir / "ckpt")
    last = _assert_failed(_check("plan.yaml"), MODEL)
    assert "plan.yaml (model)" in last


@pytest.mark.parametrize("text", ["not: [a plan\n", "- 1\n- 2\n", "schema_version: 1\n"])
def test_check_fails_on_a_file_that_is_not_a_plan(workdir, text):
    (workdir / "bad.yaml").write_text(text)
    last = _assert_failed(_check("bad.yaml"), PLAN)
    assert "bad.yaml (invalid)" in last


def test_check_several_plans_exits_with_the_first_failure(dense, workdir):
    shutil.copy("plan.yaml", "copy.yaml")  # its header names plan.yaml: a copy is the same plan, and passes
    (workdir / "stale.yaml").write_text((workdir / "plan.yaml").read_text() + "# edited by hand\n")
    (workdir / "bad.yaml").write_text("nonsense\n")
    result = _check("plan.yaml", "copy.yaml", "stale.yaml", "bad.yaml")
    last = _assert_failed(result, STALE)
    assert "2 of 4 plan(s) fail check: stale.yaml (stale); bad.yaml (invalid)" in last
    assert "-# edited by hand" in result.stdout and "fix: offload-plan make --model ckpt" in result.stderr
    assert "-o stale.yaml" in result.stderr  # the fix writes the file checked


def _measured_plan(tmp_path, **extra):
    """A --measure plan made with stand-in measurements (the runtime's are GPU-only), written to plan.yaml."""
    from planner.model.cost import ComputeTimes
    from planner.make.make_plan import make_plan
    from planner.make.inputs import regenerate_command
    from planner.plan.schema import Inputs
    from planner.plan.file import render_plan
    from tests.conftest import TEST_GPU_FILE

    make_checkpoint(tmp_path / "ckpt", num_layers=4, num_shards=2)

    def measure(checkpoint, layout, workload, profile, measured_on, graphed):
        return ComputeTimes(layer_ms=(1.0,) * len(layout.layers), head_ms=0.5, source="measured: test")

    inputs = Inputs(model=str(tmp_path / "ckpt"), gpu=str(TEST_GPU_FILE), measure=True, **extra)
    planned = make_plan(inputs, measure=measure, measure_activations=lambda *args: 1000, context_bytes=123_456_789)
    path = tmp_path / "plan.yaml"
    path.write_text(render_plan(planned.plan, regenerate_command(inputs, str(path))))
    return path, planned.plan


def test_a_measured_plan_is_checked_with_its_recorded_context(tmp_path):
    """make --measure measures what the stack holds outside the allocator (issue 36); check regenerates the plan
    from that recorded figure, as from its recorded layer times."""
    from planner.views.check import check_plan

    path, plan = _measured_plan(tmp_path, tokens=8, sequences=8, context=64)
    assert plan.hardware.cuda_context_bytes == 123_456_789
    assert plan.memory.cuda_context_bytes >= 123_456_789
    result = check_plan(path)
    assert result.ok and not result.note, result.problems


def test_a_measured_serving_plan_passes_check_saying_what_it_did_not_regenerate(tmp_path):
    """Its search timed every concurrency on a GPU: check cannot time them again, so it checks the checkpoint and
    the fit, and says so (it failed with '--measure times layers on the local GPU' before)."""
    from planner.views.check import check_plan

    path, _ = _measured_plan(tmp_path, context=256, concurrency="4")
    result = check_plan(path)
    assert result.ok and "not regenerated" in result.note, result.problems
    shutil.rmtree(tmp_path / "ckpt")
    make_checkpoint(tmp_path / "ckpt", num_layers=5, num_shards=2)
    assert [p.kind for p in check_plan(path).problems][:1] == ["fingerprint"]
