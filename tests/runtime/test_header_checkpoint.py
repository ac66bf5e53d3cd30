"""runtime.header_checkpoint: a config.json's model written as a header-only checkpoint, its bad inputs one line."""

import pytest

from planner.source.checkpoint import load_checkpoint
from planner.errors import ModelInputError, UsageError
from runtime.header_checkpoint import write_header_checkpoint


def test_missing_and_malformed_config_are_one_line_model_errors(tmp_path):
    with pytest.raises(ModelInputError, match="no such file"):
        write_header_checkpoint(tmp_path / "missing.json", tmp_path / "out")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelInputError, match="not a readable JSON"):
        write_header_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_dtype_is_a_usage_error(tmp_path, config_path):
    with pytest.raises(UsageError, match="bfloat16, float16, float32"):
        write_header_checkpoint(config_path, tmp_path / "out", dtype="int4")


def test_from_config_every_parameter_with_the_config_dtype(tmp_path, config_path):
    written = write_header_checkpoint(config_path, tmp_path / "out")
    checkpoint = load_checkpoint(str(written.folder))
    names = {t.name for t in checkpoint.tensors}
    assert written.num_tensors == len(names) == 3 + 3 * 9  # embed, norm, lm_head; 9 tensors per layer
    assert "model.layers.2.self_attn.k_proj.weight" in names
    assert {t.dtype for t in checkpoint.tensors} == {"BF16"}
