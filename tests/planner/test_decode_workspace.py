"""A routed decode step's pair workspace (experts.gather_workspace_bytes) is booked only where the decode's experts
function copies each routed pair's weights: batched_mm, the fallback for experts in any dtype but bf16; grouped_mm
(bf16) reads the device buffer in place. make writes it so, and check refuses a plan that books otherwise."""

import pytest
import yaml

from planner.errors import PlanError
from planner.plan.file import read_plan
from tests.conftest import invoke, make_checkpoint
from tests.helpers import roofline_profile

MAKE = ["--tokens", "4", "--sequences", "4", "--context", "64", "--budget", "200MiB", "--cpu-experts", "off"]


@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    """Header-only MoE checkpoints (16 experts, top-2) in bf16 and fp16, and a roofline profile."""
    monkeypatch.chdir(tmp_path)
    for dtype in ("BF16", "F16"):
        make_checkpoint(tmp_path / dtype, hidden=1024, intermediate=1024, num_heads=8, data=False, dtype=dtype,
                        moe={"num_experts": 16, "top_k": 2, "expert_intermediate": 768})
    return roofline_profile(tmp_path)


def _made(profile: str, dtype: str) -> dict:
    result = invoke(["make", "--model", dtype, "--gpu", profile, *MAKE, "-o", f"{dtype}.yaml"])
    assert result.exit_code == 0, result.stderr
    return yaml.safe_load(open(f"{dtype}.yaml"))


def test_only_a_decode_that_copies_pairs_books_their_weights(checkpoints):
    bf16, fp16 = _made(checkpoints, "BF16"), _made(checkpoints, "F16")
    for plan in (bf16, fp16):
        assert plan["experts"]["regime"] == "routed"
    assert bf16["experts"]["gather_workspace_bytes"] == 0
    experts = fp16["experts"]
    # 4 tokens x top-2 = 8 pairs of the fp16 expert's bytes: fewer resident experts, and the copy priced
    assert experts["gather_workspace_bytes"] == 4 * 2 * experts["expert_bytes"] > 0
    assert fp16["prediction"]["step_ms"] > bf16["prediction"]["step_ms"]


@pytest.mark.parametrize("dtype, booked", [("BF16", lambda e: 4 * 2 * e["expert_bytes"]), ("F16", lambda e: 0)])
def test_a_plan_booking_the_other_workspace_is_refused_in_one_line(checkpoints, dtype, booked):
    data = _made(checkpoints, dtype)
    data["experts"]["gather_workspace_bytes"] = booked(data["experts"])
    with open("edited.yaml", "w") as handle:
        yaml.safe_dump(data, handle, sort_keys=False)
    with pytest.raises(PlanError, match="gather_workspace_bytes") as error:
        read_plan("edited.yaml")
    assert "\n" not in str(error.value)
