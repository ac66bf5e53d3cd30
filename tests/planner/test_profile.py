"""planner.source.profile: GPU profiles read into the figures make plans with."""

from tests.conftest import invoke
from tests.helpers import gpu_profile, write_profile


def test_profile_with_float_byte_counts_gives_a_readable_plan(workdir, good_plan):
    data = gpu_profile(gpu_memory_bytes={"value": 1.0e9, "source": "assumed"})
    write_profile(workdir / "float.yaml", data)
    made = invoke(["make", "--model", "ckpt", "--gpu", "float.yaml", "-o", "float-plan.yaml"])
    assert made.exit_code == 0, made.stderr
    shown = invoke(["show", "float-plan.yaml", "--json"])
    assert shown.exit_code == 0, shown.stderr
