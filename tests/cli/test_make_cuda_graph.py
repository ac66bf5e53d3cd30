"""make --cuda-graph on an architecture whose decode step transformers cannot capture (issue 36: Phi-3.5-MoE's
estimated graphed plans were written, then refused by run): one line at make, and without --cuda-graph make works."""

import json
from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error, invoke

pytest.importorskip("transformers")

from planner.errors import UsageError  # noqa: E402
from tests.config_classes import tiny_config, written  # noqa: E402

SERVING = ["--gpu", "h100-sxm", "--concurrency", "1", "--gpu-memory", "8GiB", "--context", "512"]


def _phimoe_checkpoint(folder: Path) -> Path:
    """A tiny PhimoeConfig checkpoint, header-only, its tensors as the meta-device PhimoeForCausalLM names them."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from planner.source.header_checkpoint import dtype_for, write_checkpoint_folder

    config = tiny_config("phimoe", tiny_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    specs = sorted((name, dtype_for("bfloat16"), list(tensor.shape)) for name, tensor in model.state_dict().items())
    source = folder / "config" / "config.json"
    source.parent.mkdir(parents=True)
    source.write_text(json.dumps(written(config)))
    write_checkpoint_folder(config_path=source, specs=specs, out_dir=folder / "ckpt")
    return folder / "ckpt"


def test_cuda_graph_is_refused_in_one_line_for_an_uncapturable_step(workdir):
    checkpoint = _phimoe_checkpoint(workdir)
    result = invoke(["make", "-m", checkpoint, *SERVING, "--cuda-graph", "-o", "plan.yaml"], catch_exceptions=True)
    assert result.exit_code == UsageError.exit_code
    assert_one_line_error(result.exit_code, result.stderr, result.stdout,
                          contains=("--cuda-graph", "phimoe", "without --cuda-graph"))
    assert not (workdir / "plan.yaml").exists()


def test_without_cuda_graph_the_same_plan_is_made(workdir):
    checkpoint = _phimoe_checkpoint(workdir)
    result = invoke(["make", "-m", checkpoint, *SERVING, "-o", "plan.yaml"], catch_exceptions=True)
    assert result.exit_code == 0, result.stderr
    assert "cuda_graph: false" in (workdir / "plan.yaml").read_text()


def test_only_the_listed_architectures_are_refused():
    from planner.model.architectures import UNCAPTURABLE_DECODE, check_decode_capturable

    check_decode_capturable("mixtral", True)
    check_decode_capturable("phimoe", False)
    check_decode_capturable(None, True)
    for model_type in UNCAPTURABLE_DECODE:
        with pytest.raises(UsageError):
            check_decode_capturable(model_type, True)
