"""Every error line is at most ~300 characters (issue 26), even where it echoes a library's message.

``assert_one_line_error`` (tests/conftest.py) checks the length on every error path the suite already reaches;
these cases are the ones that echoed a library's text whole.
"""

import json

import pytest

from planner.errors import ModelInputError
from tests.conftest import MAX_ERROR_LINE_CHARS, assert_one_line_error, invoke


def test_header_checkpoint_of_an_encoder_decoder_config_is_a_short_model_error(tmp_path):
    """A T5 config: transformers' refusal lists every causal-LM config class (~3,000 characters); exit 70."""
    pytest.importorskip("transformers")
    config = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 64, "d_ff": 128,
              "num_layers": 2, "num_heads": 2, "d_kv": 32, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = invoke(["header-checkpoint", tmp_path / "config.json", tmp_path / "out"])
    assert result.exit_code == ModelInputError.exit_code
    assert_one_line_error(result.exit_code, result.stderr, result.stdout, contains=("'t5'", "causal"))


def test_an_unexpected_error_with_a_long_message_and_long_input_stays_short(monkeypatch):
    def crash(*args, **kwargs):
        raise ValueError("one of " + ", ".join(f"Choice{i}" for i in range(500)) + "\nand a second line")

    monkeypatch.setattr("planner.make.make_plan.make_plan", crash)
    monkeypatch.delenv("OFFLOAD_PLAN_DEBUG", raising=False)
    result = invoke(["make", "-m", "org/" + "m" * 400, "-g", "h100-sxm"], catch_exceptions=True)
    line = assert_one_line_error(result.exit_code, result.stderr, result.stdout,
                                 contains=("make failed unexpectedly", "ValueError", "this is a bug"))
    assert len(line) <= MAX_ERROR_LINE_CHARS and "second line" not in line
