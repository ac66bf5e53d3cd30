"""planner.plan.migration: a schema-1 plan reads upgraded and check calls it stale."""

import yaml

from tests.conftest import DATA_DIR as TESTS_DATA, invoke
from tests.helpers import make_golden_plan


def test_schema_1_plans_are_read_upgraded_and_checked_stale(workdir, test_gpu):
    """A plan written at schema 1 reads as schema 2 (selected_bytes from its rounded copy times, within one
    rounding step of the link) and check reports it stale, with the fix command."""
    from planner.plan.file import read_plan

    old_text = (workdir.parent / "schema-1.yaml")
    old_text.write_text((TESTS_DATA / "schema-1-moe-experts.yaml").read_text())
    assert yaml.safe_load(old_text.read_text())["schema_version"] == 1
    current = yaml.safe_load(make_golden_plan(workdir, test_gpu, "moe-experts"))
    upgraded = read_plan(old_text)
    assert upgraded.schema_version == 2 and upgraded.offload.replay_start_copies == 0
    h2d_bytes_per_ms = current["hardware"]["h2d_bytes_per_s"] / 1e3
    for row, now in zip(upgraded.layers, current["layers"]):
        assert abs(row.selected_bytes - now["selected_bytes"]) <= h2d_bytes_per_ms * 1e-4, row.index
    (workdir / "plan.yaml").write_text(old_text.read_text())
    result = invoke(["check", "plan.yaml"])
    assert result.exit_code == 8 and "out of date" in result.stderr and "+schema_version: 2" in result.stdout
