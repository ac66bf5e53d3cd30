"""planner.plan.file: plans written whole or not at all, and read back."""

from tests.conftest import TEST_GPU, assert_one_line_error, run_cli


def test_output_in_missing_folder_is_one_line_error(workdir, good_plan):
    proc = run_cli(["make", "--model", "ckpt", "--gpu", TEST_GPU, "-o", "no-such-dir/plan.yaml"], cwd=workdir)
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout)


def test_output_is_a_folder_is_one_line_error(workdir, good_plan):
    (workdir / "a-folder").mkdir()
    proc = run_cli(["make", "--model", "ckpt", "--gpu", TEST_GPU, "-o", "a-folder"], cwd=workdir)
    assert not [p for p in workdir.iterdir() if p.name.endswith(".tmp")]
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout)


def test_a_graphed_chunk_in_a_plan_without_graphed_steps_is_one_line(workdir, good_plan):
    """workload.chunk_graphed is written only when true and only beside workload.cuda_graph: a hand edit that sets it
    on an eager plan is refused in one line by every reader; a plan without the key reads as before."""
    import yaml

    plan = yaml.safe_load(good_plan)
    assert "chunk_graphed" not in plan["workload"] and not plan["workload"]["cuda_graph"]
    plan["workload"]["chunk_graphed"] = True
    (workdir / "edited.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    proc = run_cli(["show", "edited.yaml"], cwd=workdir)
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout)
    assert "chunk_graphed" in proc.stderr
    assert run_cli(["show", "out.yaml"], cwd=workdir).returncode == 0
