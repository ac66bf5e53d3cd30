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
