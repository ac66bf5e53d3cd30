"""diff on tiny hand-written checkpoints and the round-number test profile: the JSON a bot reads."""

import json


from tests.conftest import invoke, make_checkpoint
from tests.plan_cli import MOE, cli_make, replace_once


def test_diff_of_two_budgets(dense, test_gpu):
    fits = cli_make(["--gpu", test_gpu], output="fits.yaml")
    result = invoke(["diff", "plan.yaml", "fits.yaml", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["same_model"] is True
    assert data["inputs"]["changed"] == {"budget": {"old": "500KB", "new": None}}
    assert data["layers"]["to_gpu"] == dense["offload"]["layers"] and data["layers"]["to_host"] == []
    memory, prediction = data["memory"], data["prediction"]
    assert memory["gpu_bytes"] == {"old": dense["memory"]["gpu_bytes"], "new": fits["memory"]["gpu_bytes"],
                                   "change": fits["memory"]["gpu_bytes"] - dense["memory"]["gpu_bytes"]}
    assert memory["host_pinned_bytes"]["new"] == 0
    assert prediction["step_ms"]["old"] == dense["prediction"]["step_ms"]
    assert prediction["step_ms"]["new"] == fits["prediction"]["step_ms"]
    assert data["offload"]["num_offloaded"]["new"] == 0
    assert any("move to the GPU" in sentence for sentence in data["summary"])

    words = invoke(["diff", "plan.yaml", "fits.yaml"])
    assert words.exit_code == 0 and words.stderr == ""
    assert "faster" in words.stdout and "predicted step" in words.stdout and "G / K / P" in words.stdout


def test_diff_of_identical_plans_says_nothing_moved(dense):
    data = json.loads(invoke(["diff", "plan.yaml", "plan.yaml", "--json"]).stdout)
    assert data["layers"] == {"to_host": [], "to_gpu": [], "selection_changed": []}
    assert data["prediction"]["step_ms"]["change"] == 0
    assert "No layer moves" in " ".join(data["summary"])


def test_diff_of_different_models_and_hardware(dense, workdir, own_profile):
    make_checkpoint(workdir / "other", num_layers=8, num_shards=1, moe=MOE)
    replace_once(own_profile, "name: test-gpu", "name: my-gpu")
    cli_make(["--gpu", "my-gpu.yaml", "--budget", "500KB", "--params", "experts"], output="moe.yaml", model="other")
    data = json.loads(invoke(["diff", "plan.yaml", "moe.yaml", "--json"]).stdout)
    assert data["same_model"] is False
    assert (data["hardware"]["old"], data["hardware"]["new"]) == ("test-gpu", "my-gpu")
    assert "hardware test-gpu -> my-gpu" in data["summary"][0]
    assert data["offload"]["params"] == {"old": [], "new": ["experts"]}
    assert "Different checkpoints" in data["summary"][0]
